"""Running one step: the dispatcher over a rank's actions, its stages and their backward."""
