"""What every layer of the runtime shares: the process group, the topology, the process state."""
