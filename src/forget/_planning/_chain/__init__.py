"""The planner of a chain of blocks (`forget._planning`): its profile, plan and planner."""
