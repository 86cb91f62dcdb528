"""The model layer: config, parameter layout, forward pass, checkpoint loading."""
