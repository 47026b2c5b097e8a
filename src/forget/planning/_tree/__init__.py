"""The planner of any module tree (`forget.planning`): its step, candidates, profile, plan
and planner."""
