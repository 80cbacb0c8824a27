"""Results on disk, pairing of requests, ``ppspec compare`` and the plots."""
