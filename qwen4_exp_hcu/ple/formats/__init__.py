"""How PLE tables are stored in checkpoints: the row formats, our INT8 scheme and the configs that declare them."""
