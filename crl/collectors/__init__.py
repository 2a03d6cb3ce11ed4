"""Collectors: environments -> compaction engine -> validated episode TensorDicts."""
from crl.collectors.compaction_collector import CompactionCollector, EpisodeSummary, episode_stats, summary_channel_metrics
from crl.collectors.scripted import play_oracle_episode

__all__ = ["CompactionCollector", "EpisodeSummary", "episode_stats", "summary_channel_metrics", "play_oracle_episode"]
