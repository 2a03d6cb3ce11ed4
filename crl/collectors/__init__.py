"""Collectors: environments -> compaction engine -> validated episode TensorDicts."""
from crl.collectors.compaction_collector import CompactionCollector, EpisodeSummary

__all__ = ["CompactionCollector", "EpisodeSummary"]
