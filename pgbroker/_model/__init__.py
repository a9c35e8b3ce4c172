"""What a job, a message and a claimed row are: the checks and encodings made at publish, a
claim's rows and places, job keys, beat's grid. No I/O: nothing here opens a connection."""
