"""Turns a SchedulerOutput into tensors, runs the model and samples."""
