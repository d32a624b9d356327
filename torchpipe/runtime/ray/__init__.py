"""Ray actors as one more executor: the actor pool, the task server, and the executor around them."""
