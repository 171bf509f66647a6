"""Launchers: how a job is started on one or more processes (job dispatch lives in jobs/)."""
