// Package layer makes, finds and removes dsec's layers: read-only EROFS
// images in the store (package store, an OCI image layout), each an OCI
// manifest whose one blob is the image and whose config (Config) says
// what a host needs to mount it, tagged NAME:VERSION.
//
//	layer.go    Build: a source (a directory, a tar stream, a docker
//	            save or OCI archive) converted in one pass into an
//	            EROFS image (package erofs), hashed as it is written,
//	            with its window table for lazy mounts, stored and tagged
//	source.go   the sources Build reads, and what makes one bad
//	tar.go      tar entries (whiteouts, opaque directories, hard links,
//	oci.go      xattrs) as the writer takes them; docker save and OCI
//	            archives flattened into one layer
//	ops.go      List, Resolve (by tag, digest or digest prefix),
//	            Remove and GC over the store
//	profile.go  access profiles: what a run read, in first read order,
//	            which a build places first (erofs.Writer.SetOrder)
//	memory.go   what a memory snapshot keeps beside its disk diff: the
//	            guest's state, RAM and disk, and the machine it needs
//	fs.go       an EROFS image read back as an fs.FS, its names checked
//
// A snapshot is a layer too, with a Lineage: the layers it stands on.
// Images from registries are stacks of layers, kept by package image.
package layer
