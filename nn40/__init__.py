"""The modules NN_40_serving.py imports, one concept each (the README's layout table lists
them and what each may import). Only the device code (model, device, timing, experiment_ab,
experiment_d, engine_check) imports torch."""
