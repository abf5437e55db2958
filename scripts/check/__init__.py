"""Checks with a verdict (exit status): the GPU machine's one-command check
(gpu_check.sh) and the steps it runs, the GPU install check, SASS, golden streams."""
