"""Building a pipeline: the process group, the topology, the plan, and the ranks' agreement."""
