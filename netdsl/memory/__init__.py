"""Memory of a training step: the storage plan of a run (`plan`), and fitting a step into a
budget by keeping, recomputing or offloading its values (`search`), scored by a fast
simulator (`simulate`) and a cost model of the device (`cost`, `profiles`) rather than by
running the step."""
