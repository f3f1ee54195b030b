"""The cascade, the `("records", "cascade")` kind of task (`output.method: cascade`): rows embedded as
an embedding task's (pipeline/embeddings/), a teacher labels a sample and the uncertain rows, a
student on the embeddings the rest. Pure: no Dagster and no storage (lib/cascade_task.py and
storage/label_models.py keep what a task's partitions share).

    run.py          one partition's cascade (`run_cascade`): sample, student, deferred rows, audit;
                    `TaskCascade`, what the partitions of a cascade by target share
    student.py      the sample that covers the embeddings, the student trained and calibrated on the
                    teacher's labels of it, its stored rows and version
    target.py       `output.cascade.target`: one threshold per task and student version, chosen by
                    Clopper-Pearson bounds under fixed-sequence testing; what it guarantees
    labels.py       a cascade task's frames: the column and chat teachers (`Teach`), the labels and
                    who gave them (`cascade_outputs`)
    summary.py      what a partition's labels report: the audit's interval, what the labels cost
    label_model.py  the task's stored student, trained on every partition's teacher labels
    formats.py      the task format of the kind (`CascadeRecords`) and the stream it gets
                    (`CascadeStream`)
"""
