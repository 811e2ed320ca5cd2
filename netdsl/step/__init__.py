"""The step layer: one builder of the training step for every command.

`request.request_for(options, cfg, backend)` parses what a command asks into a
`StepRequest`; `build.build_step(forward, cfg, request)` builds the `Step` (graph, roles,
split, memory plan, budget, prediction); `graphs` holds the graph builders it uses.
`netdsl.runtime` runs a Step; `netdsl.api` and the CLI report on it.
"""
