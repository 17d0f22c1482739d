"""``schedule="auto"``: measure the costs, choose a schedule, try the contenders."""
