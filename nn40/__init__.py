"""The modules NN_40_serving.py imports, one concept each (the README's layout table lists
them and what each may import). Plain Python and NumPy: importing them loads no torch."""
