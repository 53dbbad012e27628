module gpusched.example/verify

go 1.22

require github.com/gowebpki/jcs v1.0.1
