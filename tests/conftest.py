# The --autopar-update-golden option, also where autopar is installed without its pytest11 entry point
# (an older editable install); pytest skips it when the entry point has registered it already.
pytest_plugins = ["autopar.pytest_plugin"]
