"""Parallel training as graph transformations (the BigData 2019 paper): data, pipeline
and tensor parallelism are rewrites of the single-device graph into one graph whose nodes
are placed on devices and connected by communication ops; see `split.split_step`."""
