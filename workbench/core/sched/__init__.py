"""Scheduling: the scheduler, the per-step SchedulerOutput, the policies and their waiting queue."""
