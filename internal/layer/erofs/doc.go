// Package erofs writes uncompressed EROFS images with 4 KiB blocks.
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
package erofs
