"""What this machine is and how to use it well: its one description (``identity``: what cost
models and reports are keyed by), how much of it other processes used (``contention``), and
splitting multi-row CPU passes over two streams (``cpu_split``).  ``dflash2-mlx doctor``'s
report is ``cli/doctor_report.py``."""
