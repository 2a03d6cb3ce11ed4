"""Collectors: environments -> compaction engine -> validated episode TensorDicts."""
from crl.collectors.compaction_collector import CompactionCollector, EpisodeSummary, episode_stats
from crl.collectors.scripted import play_oracle_episode

__all__ = ["CompactionCollector", "EpisodeSummary", "episode_stats", "play_oracle_episode"]
