"""Helpers several rules share: places (tallies by source line, costs), trends (robust statistics),
text (how messages write numbers and lines), hooks (piling hook registrations), scans (graph scans), confidence (how sure a
timing verdict is, in one vocabulary)."""
