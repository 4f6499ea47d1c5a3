"""Registration: what a task becomes when the engine admits it: its factory called in the
engine's process, its model cut into shards that fit the device budget, the parameters
several shards share found, and its entry checked into the registry."""
