"""Scheduling: the step-loop stage (plain and tiered), its policy (`Scheduler`) and the
tier planner that holds requests while their prefix loads from disk."""
