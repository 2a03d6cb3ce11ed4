"""Collectors: environments -> compaction engine -> validated episode TensorDicts."""
from crl.collectors.compaction_collector import CompactionCollector, EpisodeSummary
from crl.collectors.scripted import play_oracle_episode

__all__ = ["CompactionCollector", "EpisodeSummary", "play_oracle_episode"]
