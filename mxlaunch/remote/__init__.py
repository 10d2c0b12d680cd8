"""Models not on local disk yet: a hub id fetched once per artifact store into the hub cache the engines read."""
