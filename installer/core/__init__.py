"""The vocabulary every wing shares: errors, the `cudelta:` lines (log), every setting parsed once
(settings), the target's facts (target), CUDA versions, labels and arch targets (cuda), the wheel's
version rewrite (wheel_version), and the cudelta/ modules the run time shares, loaded by path
(shipped). Imports nothing of installer/ outside core.
"""
