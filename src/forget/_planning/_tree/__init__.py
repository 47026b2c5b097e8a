"""The planner of any module tree (`forget._planning`): its step, candidates, profile, plan
and planner."""
