// Package erofs writes EROFS images with 4 KiB blocks, their files
// uncompressed or, with SetCompress, LZ4-compressed (compress.go).
//
// The writer streams: file data is appended to the image as it arrives
// (from a directory walk or a tar stream), and everything else — directory
// blocks, long symlink targets and the inode area — is written once, at the
// end, as one contiguous metadata region:
//
//	block 0              superblock (at byte 1024)
//	blocks 1..D          file data, in the order files were added
//	blocks D..M          directory blocks and long symlink targets
//	blocks M..end        inodes (meta_blkaddr = M), each followed by its
//	                     inline xattrs, chunk map and inline tail data
//
// Stats.Metadata starts at D*4096: a host that fetches block 0 and the
// byte range [D*4096, end) eagerly can list, stat and readlink every path
// without touching the data region. Regular file tails are never inlined,
// so the metadata region holds no file bytes.
//
// Fidelity: every inode is an extended (64-byte) inode, so owners up to
// 2^32-1, sizes above 4 GiB and mtimes with nanoseconds survive. Hard
// links share one inode. Xattrs in the user., trusted., security. and
// system.posix_acl_* namespaces are stored inline. Aligned 1 MiB runs of
// zeros become holes of a chunk-based file, so sparse files stay small.
//
// Determinism: directory entries are sorted by name bytes, inodes are
// numbered breadth first from the root, and no wall-clock time, UUID or
// random value is written, so the same sequence of calls always gives the
// same bytes. Data blocks are placed in call order: callers that want the
// same image for the same tree add files in a canonical order (the
// directory walker in package layer adds them in sorted depth-first order).
// SetOrder moves the planned files it names to the front of the data
// region, in its order (Stats.Hot): an access profile recorded from a run
// becomes one contiguous range that a lazy mount fetches in few windows.
//
// # Why dsec keeps its own writer
//
// go-erofs (github.com/erofs/go-erofs, a dependency for reading images
// in tests) ships a writer too since v0.3.1, erofs.Create, with a
// data-first layout like this one. dsec keeps its own for what that one
// does not do: it writes a tar stream in one pass, with no spool file
// and no second read of the data (a layer is built as it is pulled);
// SetOrder places a recorded profile's files first, as one hot region;
// and aligned 1 MiB runs of zeros become holes. An ordering hook in
// go-erofs would let dsec use its writer for the rest; until then this
// one is split by stage, as go-erofs splits its own:
//
//	writer.go   the Writer, its options and what Finish reports
//	tree.go     the path tree: directories, links, whiteouts, removal
//	data.go     file data appended as it arrives, with holes
//	plan.go     planned files: the hot region first, then in plan order
//	xattr.go    extended attributes, encoded inline
//	layout.go   Finish, stage by stage: inodes ordered, sized, placed;
//	            directory blocks; the inode area; the superblock; written
//	compress.go LZ4 extents of streamed files, and a view of a
//	            compressed image for readers that know no compression
//	format.go   the on-disk constants and the in-memory inode
package erofs
