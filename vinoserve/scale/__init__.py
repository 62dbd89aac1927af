"""`vinoserve serve --replicas N`: N engine processes, each on its own cores, behind SGLang's
router (the `scale` extra). Nothing here routes: the router does."""
