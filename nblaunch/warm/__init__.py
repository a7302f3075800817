"""Warm ranks: processes and a process group that outlive a call (``WarmRanks``, ``%%distributed``)."""
