"""Each optimization as plain functions on modules, tensors and optimizers: no Lightning needed."""
