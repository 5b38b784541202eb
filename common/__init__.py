"""batchwire.common: small tools shared by server, client, trainer, bench and tests.

They import nothing of batchwire but `batchwire.wire`, so every side can use them without
pulling in the server.
"""
