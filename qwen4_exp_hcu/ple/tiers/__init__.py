"""Where a table's rows live beyond the accelerator: pinned host pages, hot rows on the GPU, rows read from the checkpoint files."""
