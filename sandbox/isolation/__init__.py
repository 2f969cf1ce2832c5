"""OS isolation of task commands: a `Sandbox` runs each command confined (`sandbox`) in its own
read-only view of the host (`hostview`)."""
