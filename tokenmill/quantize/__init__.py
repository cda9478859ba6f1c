"""`tokenmill quantize`: a checkpoint quantized into one of the formats tokenmill reads (a front
end above every room: it builds a model, runs calibration forwards and writes safetensors)."""
