"""What a run reports: metrics files and W&B, rank 0's log, progress display and the
start-up / throughput report.
"""
