package layer

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

// An access profile lists what a run read, in first read order, one file
// a line: its path (absolute within the layer) for the whole file, or its
// path, a tab and the block ranges read ("START+COUNT" in 4 KiB blocks of
// the file, comma-separated). Blank lines and lines starting with # are
// skipped. dsec layer profile writes one; layer build --order reads one.

// FormatProfile writes a profile. A path holding a tab or a newline
// cannot be written and is left out (the file keeps its usual place).
func FormatProfile(hot []erofs.Hot) []byte {
	var b bytes.Buffer
	for _, h := range hot {
		if strings.ContainsAny(h.Path, "\t\n") {
			continue
		}
		b.WriteString(h.Path)
		for i, r := range h.Blocks {
			sep := ","
			if i == 0 {
				sep = "\t"
			}
			fmt.Fprintf(&b, "%s%d+%d", sep, r.Start, r.Count)
		}
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// maxProfileBlocks bounds a range's end: no file of a layer has more
// blocks than an image can address.
const maxProfileBlocks = 1 << 32

// ParseProfile reads a profile.
func ParseProfile(r io.Reader) ([]erofs.Hot, error) {
	var hot []erofs.Hot
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimRight(sc.Text(), "\r")
		if strings.TrimSpace(line) == "" || strings.HasPrefix(line, "#") {
			continue
		}
		p, ranges, split := strings.Cut(line, "\t")
		if _, err := erofs.SplitPath(p); err != nil {
			return nil, fmt.Errorf("profile line %d: %v: %w", n, err, errdefs.ErrInvalidArgument)
		}
		h := erofs.Hot{Path: p}
		if split {
			for _, f := range strings.Split(ranges, ",") {
				s, c, ok := strings.Cut(f, "+")
				start, err1 := strconv.ParseUint(s, 10, 64)
				count, err2 := strconv.ParseUint(c, 10, 64)
				if !ok || err1 != nil || err2 != nil || count == 0 || start >= maxProfileBlocks || count > maxProfileBlocks-start {
					return nil, fmt.Errorf("profile line %d: %q is not a block range START+COUNT: %w", n, f, errdefs.ErrInvalidArgument)
				}
				h.Blocks = append(h.Blocks, erofs.BlockRange{Start: start, Count: count})
			}
		}
		hot = append(hot, h)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("profile: %w", err)
	}
	return hot, nil
}
