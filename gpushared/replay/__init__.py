"""Trace replay: the Alibaba GPU trace ("openb") scheduled by the extender's own policy code, the way the
FGD paper's simulator schedules it, to measure how much of a cluster each policy gets allocated."""
