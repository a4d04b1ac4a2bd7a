"""Store protocols and the stores that ship with the kit."""
