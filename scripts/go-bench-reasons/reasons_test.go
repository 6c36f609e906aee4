// What kube-scheduler pays to decode an extender's filter answer: the ExtenderFilterResult shape with one
// node passing and the rest left out with a reason, decoded by Go's encoding/json as kube-scheduler's
// HTTPExtender does (docs/benchmarks.md, "Failed nodes' reasons only when no node passes").
//
//	cd scripts/go-bench-reasons && go test -bench . -benchtime 3000x
package reasons

import (
	"encoding/json"
	"fmt"
	"testing"
)

// filterResult mirrors kube-scheduler's ExtenderFilterResult (k8s.io/kube-scheduler/extender/v1).
type filterResult struct {
	Nodes                      *struct{}         `json:"nodes,omitempty"`
	NodeNames                  *[]string         `json:"nodenames,omitempty"`
	FailedNodes                map[string]string `json:"failedNodes,omitempty"`
	FailedAndUnresolvableNodes map[string]string `json:"failedAndUnresolvableNodes,omitempty"`
	Error                      string            `json:"error,omitempty"`
}

// answer is a filter answer over `candidates` nodes: the first passes, the others carry a reason.
func answer(candidates int) []byte {
	failed := map[string]string{}
	for i := 1; i < candidates; i++ {
		failed[fmt.Sprintf("node-%05d", i)] = "fits, but the binpack policy ranks other nodes higher"
	}
	body, err := json.Marshal(map[string]interface{}{
		"Nodes": nil, "NodeNames": []string{"node-00000"}, "FailedNodes": failed,
		"FailedAndUnresolvableNodes": map[string]string{}, "Error": "",
	})
	if err != nil {
		panic(err)
	}
	return body
}

func decode(b *testing.B, candidates int) {
	body := answer(candidates)
	b.SetBytes(int64(len(body)))
	for i := 0; i < b.N; i++ {
		var result filterResult
		if err := json.Unmarshal(body, &result); err != nil {
			b.Fatal(err)
		}
	}
}

// One node passes and no reasons come back: what filter answers now.
func BenchmarkNoReasons(b *testing.B) { decode(b, 1) }

// 420 and 500 candidates: kube-scheduler 1.20's adaptive share of 1,000 and 5,000 nodes.
func BenchmarkReasons420(b *testing.B) { decode(b, 420) }
func BenchmarkReasons500(b *testing.B) { decode(b, 500) }
