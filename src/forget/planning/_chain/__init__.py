"""The planner of a chain of blocks (`forget.planning`): its profile, plan and planner."""
