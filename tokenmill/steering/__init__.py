"""Refusal steering beyond the forward pass: building a direction (`tokenmill steer build`), reading a
request's strengths (dial.py) and the refusal detector (detector.py). The ablation itself is
layers/steering.py; the file format models/steering_file.py."""
