package snap

import (
	"bufio"
	"encoding/binary"
	"errors"
	"io"
	"os"
)

// Limits bound what one pack takes from an upper. Zero fields get the
// defaults.
type Limits struct {
	MaxBytes   int64 `json:"max_bytes,omitempty"`   // file data
	MaxEntries int   `json:"max_entries,omitempty"` // paths
	MaxDepth   int   `json:"max_depth,omitempty"`   // directory nesting
}

// The default limits: generous for an agent's rollout, small enough
// that a runaway upper fails with a clear error instead of filling the
// store.
const (
	DefaultMaxBytes   = 64 << 30
	DefaultMaxEntries = 1 << 21
	DefaultMaxDepth   = 256
)

// WithDefaults is l with the default of each bound it leaves unset.
func (l Limits) WithDefaults() Limits {
	if l.MaxBytes <= 0 {
		l.MaxBytes = DefaultMaxBytes
	}
	if l.MaxEntries <= 0 {
		l.MaxEntries = DefaultMaxEntries
	}
	if l.MaxDepth <= 0 {
		l.MaxDepth = DefaultMaxDepth
	}
	return l
}

// Entry is what a pack saw of one path of the upper. An inode whose
// change time is the same has not changed: writes, chmod, chown,
// xattrs, links and renames all set it, and nobody in a sandbox may set
// it back (that takes setting the clock).
type Entry struct {
	Ino   uint64
	Ctime int64 // ns
	Dir   bool
}

// Index is what a pack saw of the upper, by path, so the next pack of
// the same upper adds only what changed.
type Index map[string]Entry

const indexMagic = "dsec-snap-index-1\n"

// WriteIndex stores idx for the snapshot whose layer digest is top,
// atomically.
func WriteIndex(p, top string, idx Index) error {
	tmp := p + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	bw := bufio.NewWriterSize(f, 1<<16)
	bw.WriteString(indexMagic)
	bw.WriteString(top + "\n")
	var b [binary.MaxVarintLen64*3 + 1]byte
	for path, e := range idx {
		n := binary.PutUvarint(b[:], uint64(len(path)))
		bw.Write(b[:n])
		bw.WriteString(path)
		n = binary.PutUvarint(b[:], e.Ino)
		n += binary.PutVarint(b[n:], e.Ctime)
		if e.Dir {
			b[n] = 1
		} else {
			b[n] = 0
		}
		bw.Write(b[:n+1])
	}
	if err := bw.Flush(); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil { // a half-written index would hide deletions
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, p)
}

// ReadIndex loads the index at p if it belongs to the snapshot whose
// layer digest is top; otherwise (none, another snapshot's, damaged) it
// returns nil: the next pack then takes the whole upper.
func ReadIndex(p, top string) (Index, error) {
	f, err := os.Open(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	br := bufio.NewReaderSize(f, 1<<16)
	head := make([]byte, len(indexMagic))
	if _, err := io.ReadFull(br, head); err != nil || string(head) != indexMagic {
		return nil, nil
	}
	d, err := br.ReadString('\n')
	if err != nil || d != top+"\n" {
		return nil, nil
	}
	idx := Index{}
	for {
		n, err := binary.ReadUvarint(br)
		if err == io.EOF {
			return idx, nil
		}
		if err != nil || n > 1<<20 {
			return nil, nil
		}
		name := make([]byte, n)
		if _, err := io.ReadFull(br, name); err != nil {
			return nil, nil
		}
		var e Entry
		if e.Ino, err = binary.ReadUvarint(br); err != nil {
			return nil, nil
		}
		if e.Ctime, err = binary.ReadVarint(br); err != nil {
			return nil, nil
		}
		flag, err := br.ReadByte()
		if err != nil {
			return nil, nil
		}
		e.Dir = flag == 1
		idx[string(name)] = e
	}
}
