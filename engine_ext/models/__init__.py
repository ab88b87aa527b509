"""Small models built on the fly (random weights, no download) for tests, demos and checks."""
