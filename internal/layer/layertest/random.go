package layertest

import (
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
)

// RandomTree writes n files of size bytes under dir (f000, f001, ...),
// their content random from seed: the same seed, the same files, and no
// compression hides a copy.
func RandomTree(dir, seed string, n, size int) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	r := rand.NewChaCha8(sha256.Sum256([]byte(seed)))
	for i := range n {
		buf := make([]byte, size)
		r.Read(buf)
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%03d", i)), buf, 0o644); err != nil {
			return err
		}
	}
	return nil
}
