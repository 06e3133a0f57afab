"""Fault suite: hostile clients, dying parts, full disks — real components.

Each module drives a real part (here: the control server in its own process) through
one class of fault and asserts what chandrad must still do, with figures.
"""
