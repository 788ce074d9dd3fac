"""After the runs: Pass@k and paired statistics, plots, heatmaps, the study folder."""
