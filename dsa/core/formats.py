"""The format version of each artifact the rule set writes, in one place.

A reader refuses a format it does not know; docs/manifest.md and docs/bundle-format.md say when a version
moves. Every writer and reader takes its version from here, so two modules can never disagree.
"""

# <name>.modules.json: the module index the runtime loads (dsa_vmfb, dsa compile).
INDEX_FORMAT = 1
# Parameter archives (.irpa): each entry's metadata is this prefix + JSON {type, dtype, shape}, as
# iree-turbine's ParameterArchiveBuilder writes it, so turbine's ParameterArchive reads ours back.
PARAMETER_METADATA_PREFIX = "PYTORCH:"
# <name>.lock.json: the recipe lock (DsaLock, dsa compile).
LOCK_FORMAT = 1
# link.json: the checked edges of a dsa_pipeline (DsaLink).
LINK_FORMAT = 1
# <name>.pipeline.json: the stages of a dsa_pipeline, in run order.
PIPELINE_INDEX_FORMAT = 1
