"""The build's Genie folders: the decoder in Genie's I/O contract, its files, the media towers as
pipeline nodes, GenieX's files, and their oracle."""
